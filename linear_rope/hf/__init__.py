"""Hugging Face integration (``pip install "linear_rope[hf]"``): every ``PerformerLM`` variant as a
transformers causal LM, registered with ``AutoConfig``, ``AutoModelForCausalLM`` and
``AutoTokenizer`` when this module is imported.

    import linear_rope.hf  # registers model_type "linear_rope"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")   # python -m linear_rope.export RUN OUT
    tok = AutoTokenizer.from_pretrained("exported/")
    ids = tok(["The ", "Rotary "], return_tensors="pt", padding=True)  # left padding
    out = model.generate(**ids, max_new_tokens=20)  # greedy: the generation config's do_sample is False

An exported folder also loads with ``from_pretrained(OUT_DIR, trust_remote_code=True)`` and no
import: its ``auto_map`` names ``modeling_linear_rope.py``, which imports the installed package.

* ``configuration.py`` ``LinearRopeConfig``: ``ModelConfig``'s fields, checked under their own
                       names and transformers' (``hidden_size``, ``rope_theta``, ...);
* ``modeling.py``      ``LinearRopeForCausalLM``;
* ``cache.py``         its ``RecurrentCache`` (the O(1) state) and the reading of tokens into it;
* ``loading.py``       a folder's config checked against its weights' headers before building;
* ``inputs.py``        the checks ``forward`` runs on its inputs (``prompt.py``: ``generate``'s);
* ``tokenization.py``  ``ByteTokenizer``: UTF-8 bytes, id = byte;
* ``export.py``        ``python -m linear_rope.export RUN_DIR OUT_DIR``: a training run's
                       checkpoint as a ``save_pretrained`` folder (safetensors).
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # one line, with the fix
    raise ImportError(f"linear_rope.hf needs transformers: pip install \"linear_rope[hf]\" ({e})") from None

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .configuration import ConfigFieldError, LinearRopeConfig
from .modeling import LinearRopeForCausalLM, RecurrentCache
from .tokenization import ByteTokenizer

__all__ = ["LinearRopeConfig", "ConfigFieldError", "LinearRopeForCausalLM", "RecurrentCache", "ByteTokenizer"]

AutoConfig.register(LinearRopeConfig.model_type, LinearRopeConfig, exist_ok=True)
AutoModelForCausalLM.register(LinearRopeConfig, LinearRopeForCausalLM, exist_ok=True)
AutoTokenizer.register(LinearRopeConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)
