"""Kernel tests run the Triton kernels on the CPU through the interpreter.

triton decides interpretation when a kernel is decorated, i.e. when services.engine.kernels.sgmv_triton
is first imported (the engine imports it lazily, only for Triton launches); this conftest is loaded
before any test module here, so setting the variable now is early enough.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"
