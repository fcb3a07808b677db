"""A loaded model: resolve it, load it, tokenize and render, run it, choose its tokens.

The modules: ``resolve.py`` (a model name → a local MLX folder, and its digest), ``gguf.py``
(the embedded default model, converted once from a registry package's GGUF), ``mlxlm.py``
(mlx-lm's modules without its package root), ``preload.py`` (what a load does besides building
the model), ``tokenizer/`` (the tokenizer and chat template without transformers),
``engine.py`` (``Engine``: render, prefill, decode — the only module that runs the model),
``info.py`` (what its KV cache costs), ``sampler.py`` (the next token from the logits, and a
draft's check), ``defaults.py`` (the sampling settings a request leaves open),
``endtokens.py`` (where a reply ends), ``replies.py`` (the tool calls inside a reply) and
``toolcalls.py`` (the grammar that holds strict tools' calls to their schemas).

What it is not: conversations, turns or the cache on disk; the session drives it.
"""
