"""`engram-lm-eval`: lm-eval's own command line, with the `engram` model registered first.

`engram-lm-eval --model engram --model_args pretrained=FOLDER --tasks ...` takes `lm_eval`'s arguments
unchanged. It exists because lm-eval 0.4.13 reads no plugin entry points: with a release that reads
`lm_eval.models` (ours is in pyproject.toml), `lm_eval --model engram` does the same. lm-eval parses
the arguments (its parser, not one of ours); this module only registers the model and hands over.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from lm_eval.__main__ import cli_evaluate

        from engram.hf.harness import register
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "lm_eval":
            raise
        print(
            "engram-lm-eval: error: lm-eval is not installed: pip install 'engram-lm[eval]'", file=sys.stderr
        )
        return 2
    register()
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
