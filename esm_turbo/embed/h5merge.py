"""The follower process behind ``H5Writer.start_merging``: ``python -m esm_turbo.embed.h5merge OUT META`` folds
``OUT.parts/*.h5`` into ``OUT`` as they land, until its stdin is closed (every rank has finished writing). META is
the JSON the output records about how it was made."""

import json
import sys
import threading

from .writers import follow_parts


def main(out: str, meta: str = "null") -> int:
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    follow_parts(out, done=closed.is_set, meta=json.loads(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
