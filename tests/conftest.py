import os

# The Triton interpreter must be chosen before triton is first imported (flashmax imports it).
# On a machine with a GPU, FLASHMAX_TEST_DEVICE=cuda runs the same tests on the compiled kernels.
if os.environ.get("FLASHMAX_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
