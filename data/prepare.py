"""``python -m data.prepare data=embedded tokenizer=bpe_local [data.key=value ...]``.

The command lives apart from ``data.preparation`` because ``data.prepare`` must stay the
*function* exported by the package (importing a submodule of the same name would shadow it).
"""
import sys

from data.preparation import main

if __name__ == "__main__":
    sys.exit(main())
