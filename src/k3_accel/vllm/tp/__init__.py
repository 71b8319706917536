"""Tensor-parallel all-reduce in vLLM: the communicator override and the ``vllm::k3_all_reduce`` op.

``communicator`` (``K3CudaCommunicator``, the platform hook) and ``custom_op``
are installed by :func:`k3_accel.plugin.register`; the routing itself lives in
:mod:`k3_accel.comm`.
"""
