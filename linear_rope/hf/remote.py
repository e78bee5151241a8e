"""What makes a saved folder load with ``trust_remote_code=True`` and no ``import linear_rope.hf``:
``auto_map`` entries naming ``modeling_linear_rope.py``, a file that only imports the installed
package's classes (so the code that runs is the package's, whatever version is installed)."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REMOTE_CODE_FILE", "REMOTE_CODE", "AUTO_MAP", "TOKENIZER_AUTO_MAP", "write_remote_code",
           "add_tokenizer_auto_map"]

REMOTE_CODE_FILE = "modeling_linear_rope.py"
# Subclasses, not the classes themselves: transformers marks a class it loads as remote code
# (``register_for_auto_class``), and a later save copies that class's own file.
REMOTE_CODE = '''"""linear_rope's Hugging Face classes, for ``trust_remote_code=True``. The code is the installed
``linear_rope`` package's (with its [hf] extra): this file only names its classes."""
from linear_rope.hf import configuration, modeling, tokenization


class LinearRopeConfig(configuration.LinearRopeConfig):
    pass


class LinearRopeForCausalLM(modeling.LinearRopeForCausalLM):
    config_class = LinearRopeConfig


class ByteTokenizer(tokenization.ByteTokenizer):
    pass
'''
AUTO_MAP = {"AutoConfig": "modeling_linear_rope.LinearRopeConfig",
            "AutoModelForCausalLM": "modeling_linear_rope.LinearRopeForCausalLM"}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["modeling_linear_rope.ByteTokenizer", None]}


def write_remote_code(folder) -> None:
    (Path(folder) / REMOTE_CODE_FILE).write_text(REMOTE_CODE)


def add_tokenizer_auto_map(tokenizer_config) -> None:
    """``auto_map`` into a saved ``tokenizer_config.json``."""
    path = Path(tokenizer_config)
    path.write_text(json.dumps({**json.loads(path.read_text()), "auto_map": TOKENIZER_AUTO_MAP}, indent=2) + "\n")
