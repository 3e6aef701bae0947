"""The response-length predictor: a small DistilBERT-style length-bucket classifier.

Training (:mod:`predictor.training`, ``fleetbatch predictor train``), evaluation against baselines
(:mod:`predictor.evaluation`), serving in the gateway (:mod:`predictor.serving`: the learned
model shipped with the project by default, :mod:`predictor.shipped`), and retraining on the
lengths engines observed (:mod:`predictor.observed`, :mod:`predictor.adapt`).
"""
