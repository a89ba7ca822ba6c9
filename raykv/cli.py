"""`raykv` command line: plan, up / status / down, demo, bench.

Each command imports what it needs when it runs, so `raykv --help` stays fast.
"""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raykv")
def main() -> None:
    """raykv: a distributed KV-cache service for LLM inference, built on Ray."""


# --- plan (issue 2) ----------------------------------------------------------------------


# --- service: up / status / down / demo (issue 4) ---------------------------------------


# --- bench -------------------------------------------------------------------------------


@main.group()
def bench() -> None:
    """Benchmarks that print ratios measured side by side in one run."""


if __name__ == "__main__":
    main()
