"""The ``esm-turbo`` entry point: ``embed --gpus N`` starts its N rank processes before anything heavy is imported
(:mod:`esm_turbo.embed.launch`); every other command line goes to :mod:`esm_turbo.cli`."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .embed.launch import gpus_asked
    value = gpus_asked(argv)
    if value is not None and "WORLD_SIZE" not in os.environ and not {"-h", "--help"} & set(argv):
        from .embed.launch import launch_ranks, rank_count
        from .errors import EsmTurboError
        try:
            ranks = rank_count(value)
        except EsmTurboError as err:
            print(f"esm-turbo: error: {err}", file=sys.stderr)
            return 2
        if ranks > 1:
            return launch_ranks(argv, ranks)
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
