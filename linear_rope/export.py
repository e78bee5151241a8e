"""``python -m linear_rope.export RUN_DIR OUT_DIR``: a training run's checkpoint as a Hugging Face
folder (see ``linear_rope/hf/export.py``; needs ``pip install "linear_rope[hf]"``)."""
import sys

PROG = "python -m linear_rope.export"


def main(argv: list[str] | None = None) -> int:
    try:
        from .hf.export import main as export_main
    except ImportError as e:  # transformers is not installed: one line, exit 2
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return export_main(argv, PROG)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
