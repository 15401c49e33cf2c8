"""The ``voodoo`` command line. Each subcommand is one stage of the pipeline (see README.md);
``voodoo run`` chains them."""

from __future__ import annotations

import argparse
import sys


def _bootstrap(argv):
    from . import llamacpp
    return llamacpp.main(argv)


def _doctor(argv):
    from . import doctor
    argparse.ArgumentParser(prog="voodoo doctor", description=doctor.__doc__.split("\n")[0]) \
        .parse_args(argv)
    return doctor.run()


COMMANDS = {
    "bootstrap": (_bootstrap, "fetch the pinned llama.cpp, build libggml-base and the tools"),
    "doctor": (_doctor, "check the installation and self-check the libggml bridge"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: voodoo COMMAND [options]\n\ncommands:")
        for name, (_, helptext) in COMMANDS.items():
            print(f"  {name:<13} {helptext}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nvoodoo: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    fn, _ = COMMANDS[argv[0]]
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
