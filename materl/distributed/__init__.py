"""Scale-out: a pipeline whose rollouts run ahead of the learner by a bounded number of policy
versions (``pipeline``), versioned weight publication (``versions``), rollout workers in this
process or on Ray (``workers``, ``ray_workers``) with a router (``router``), and the rollout side
built from a compiled step (``launch``)."""
