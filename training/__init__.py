"""Training the embedded pair (train_pair.py, distill.py, accelerated.py on a GPU) and writing its
model card; training a feature-level draft head for its target (feature_head.py) and writing its
card (head_card.py). Run by hand as scripts (`python -m training.accelerated ...`), never by the
serving system.

May import: svip_common, draft_worker (the feature head), coordinator (the engine, to measure the
pair), svip_assets, svip_bench (its held-out prompts and machine line, to measure the head)."""
