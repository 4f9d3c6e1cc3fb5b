"""Scale-out: a pipeline whose rollouts run ahead of the learner by a bounded number of policy
versions (``pipeline``), versioned weight publication (``versions``), rollout workers in this
process or on Ray (``workers``, ``ray_workers``) with a router (``router``), the rollout side
built from a compiled step (``launch``); and a data-parallel learner on torch.distributed
(``learner``: FSDP2 or DDP; gloo on CPU, NCCL on GPU), started by ``torchrun -m
materl.distributed.torchrun`` or as Ray actors (``ray_group.LearnerGroup``)."""
