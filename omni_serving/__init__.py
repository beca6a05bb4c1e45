"""The omni_serving contract: generated protobuf and gRPC modules only.

Modules under omni_serving.v1 are generated from protos/omni_serving/v1 at
build time (scripts/gen_protos.py); never edit them by hand.
"""
