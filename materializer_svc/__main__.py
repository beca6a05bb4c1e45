from materializer_svc.server import main
from omni_common.fast_exit import run_service

if __name__ == "__main__":
    run_service(main)
