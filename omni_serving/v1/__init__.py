"""Generated modules of the omni_serving.v1 contract."""
