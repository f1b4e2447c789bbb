"""How the work is spread (never what forgetting is):

  runtime               Ray: connect to a cluster (--address / RAY_ADDRESS) or start one locally on loopback
  worker, pool          Ray actors holding one model version each; fault-tolerant dispatch of shard calls
  probe_pool            the perturbation probe sharded over a pool (RemovalProblem.probe_runner)
  curvature_pool        training-set Hessian-vector products sharded over a pool (curvature_factory)
  weights               weight fingerprints so (re)started workers compute on the driver's weights
  deepspeed_mixed_linear  Mixed-Linear training/forgetting data-parallel across DeepSpeed ranks
  ray-cluster.yaml, rayjob.yaml, Dockerfile   cluster specs (Ray cluster launcher, KubeRay RayJob, image)
"""
