"""File formats shared by both tools: circle models (model.py, over the bindings
generated from schemas/circle.fbs) and the weight-only .wof files (wof.py)."""
