"""ZeRO and the optimizer step over distributed parameters: an optimizer's sharding
(`sharding.py`), one `ZeroParam` per parameter (`param.py`), states placed where parameters
are stepped (`states.py`), the step on local pieces (`local_step.py`), ZeRO-3's per-layer
units (`zero3.py`), and flat buckets (`flat_shards.py`)."""
