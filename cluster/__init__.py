"""How the work is spread (never what forgetting is):

  runtime               Ray: connect to a cluster (--address / RAY_ADDRESS) or start one locally on loopback
  worker, pool          Ray actors holding one model version each; fault-tolerant dispatch of shard calls
  shards                the one shard planner (contiguous ranges aligned to passes / batches)
  probe_pool            the perturbation probe sharded over a pool (a ProbeRunner)
  curvature_pool        training-set Hessian-vector products sharded over a pool (a CurvatureFactory)
  hooks                 ray_removal_hooks: both of the above on one pool, for pipeline.removal.remove
  weights               weight fingerprints so (re)started workers compute on the driver's weights
  net                   free_port on loopback
  deepspeed_mixed_linear  the process group, summing all-reduce and ZeRO store under which each rank
                        runs pipeline.methods.mixed_linear.run_data_parallel
  ray-cluster.yaml, rayjob.yaml, Dockerfile   cluster specs (Ray cluster launcher, KubeRay RayJob, image)
"""
