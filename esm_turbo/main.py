"""The ``esm-turbo`` entry point: ``embed --gpus N`` starts its N rank processes before anything heavy is imported
(:mod:`esm_turbo.embed.launch`); every other command line goes to :mod:`esm_turbo.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(argv):
        from .embed.launch import launch_if_asked
        from .errors import EsmTurboError
        try:
            code = launch_if_asked(argv)
        except EsmTurboError as err:
            print(f"esm-turbo: error: {err}", file=sys.stderr)
            return 2
        if code is not None:
            return code
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
