"""Evaluation of removals: metrics, membership attacks, comparison with Retrain, curves, plots.

One module per concern:
  protocol        the evaluation protocol (EvalConfig, evaluate): what `unlearn eval` runs
  removal_metrics accuracies before / after one removal (a campaign's verification)
  predict         batched logits / probabilities of a model on a SampleSet
  classification  accuracy, micro-F1, UA / RA / TA
  mia             population MIA with an SVC on confidence features (MIA-efficacy)
  lira            per-example likelihood-ratio attack (LiRA / U-LiRA)
  retrieval       mAP and rank-1 for re-ID retrieval
  divergence      KL between output distributions
  weights         residual gradient norm, distance between weight vectors
  forget_sets     random-sample and whole-class forget-set builders
  baselines       Retrain and fine-tune baselines, cached per forget set
  scorecard       UA/RA/TA/MIA table rows and Avg. Gap against Retrain
  curves          removal curves over sequential removals
  plots           matplotlib PNGs
"""
