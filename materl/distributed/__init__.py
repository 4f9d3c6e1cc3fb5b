"""Scale-out, learner side: a data-parallel learner on torch.distributed (FSDP2 or DDP; gloo on
CPU, NCCL on GPU), launched by ``torchrun`` (``python -m materl.distributed.launch``) or as Ray
actors (``LearnerGroup``, ``pip install "materl[ray]"``). See ``learner.py`` for how a step is
split across ranks with global loss normalisers."""
