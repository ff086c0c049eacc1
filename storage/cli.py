"""The ``ecsnap`` command: ``serve``, ``status``, ``bench``."""

from __future__ import annotations

import sys


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ecsnap bench {codec,store,persist,train,scale,faults,soak} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "codec":
        from bench.codec import main as codec_main

        return int(codec_main(rest))
    if name == "scale":
        from bench.scale import main as scale_main

        return int(scale_main(rest))
    if name == "train":
        from bench.train import main as train_main

        return int(train_main(rest))
    if name == "faults":
        from bench.faults import main as faults_main

        return int(faults_main(rest))
    if name == "soak":
        from bench.faults import soak_main

        return int(soak_main(rest))
    if name == "persist":
        from bench.persist import main as persist_main

        return int(persist_main(rest))
    if name == "store":
        from bench.store import main as store_main

        return int(store_main(rest))
    print(
        f"ecsnap bench: unknown benchmark {name!r}; choose codec, store, persist, "
        "train, scale, faults or soak",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: ecsnap {serve,status,demo,bench} [options]  (ecsnap COMMAND --help for more)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return _bench(rest)
    if command == "serve":
        from storage.daemon import main as serve_main

        return int(serve_main(rest))
    if command == "demo":
        from bench.demo import main as demo_main

        return int(demo_main(rest))
    if command == "status":
        from storage.status import main as status_main

        return int(status_main(rest))
    print(f"ecsnap: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
