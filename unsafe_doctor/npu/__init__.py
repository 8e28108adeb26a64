"""torch_npu as this tool knows it: the error texts torch_npu prints (`messages`, read by the log
path, which never imports torch) and the unsafe backend (`backend`: torch_npu's own recovery API on
an NPU, an emulation by a torch dispatch mode elsewhere) that the sentinel and the replay mark and
check tensors with.

The lowest stage: it imports only `unsafe_doctor.errors`. `backend` imports torch; nothing else here does.
"""
