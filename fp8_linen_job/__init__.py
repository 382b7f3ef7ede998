"""The main job of fp8_linen: train small models in bf16 and quantized arms.

Run it with ``python -m fp8_linen`` (or the ``fp8-linen-train`` script); see
:mod:`fp8_linen_job.main`. Modules:

* :mod:`~fp8_linen_job.config`: frozen config dataclasses and the YAML loader.
* :mod:`~fp8_linen_job.data`: stdlib source text and sklearn digits, batched
  deterministically by step.
* :mod:`~fp8_linen_job.models`: transformer LM and CNN with injectable
  dense/conv classes.
* :mod:`~fp8_linen_job.arms`: which layer and train-state classes each arm
  uses.
* :mod:`~fp8_linen_job.tasks`: data + model + optimizer per task.
* :mod:`~fp8_linen_job.train`: jit train step, evaluation, orbax checkpoints
  and exact resume.
* :mod:`~fp8_linen_job.quant_state`: traces and health checks of the
  quantization state, fp8 (via :mod:`fp8_linen.monitor`) and integer.
* :mod:`~fp8_linen_job.report`: tables, plots and the JSON summary.

"""
