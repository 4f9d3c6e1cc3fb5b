"""Scale-out, learner side: a data-parallel learner on torch.distributed (``learner``: FSDP2 or
DDP; gloo on CPU, NCCL on GPU), started by ``torchrun -m materl.distributed.torchrun`` or as Ray
actors (``ray_group.LearnerGroup``, ``pip install "materl[ray]"``)."""
