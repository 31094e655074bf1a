"""``minifield fetch-inputs``: fetch, verify and place every remote input of a recipe.

Exit codes: 0 every remote input verified and placed in DEST under its name;
1 a fetch failed (network, HTTP status, size or sha256); 2 the job or the
fetch settings are invalid (recipe, origin list, credentials file, CA bundle).
A JSON record of what was fetched is printed on stdout; reasons go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..inputs import credentials, fetch, origins
from . import bounded_float, bounded_int, load_recipe


def run(args) -> int:
    recipe = load_recipe(args.job)
    if recipe is None:
        return 2
    try:
        settings = fetch.Settings(
            allowed_origins=args.allow_origin,
            cache_dir=args.cache,
            credentials=credentials.load(args.credentials_file),
            ca_bundle=args.ca_bundle,
            allow_insecure_loopback=args.allow_insecure_loopback,
            max_attempts=args.max_attempts,
            backoff_seconds=args.backoff_seconds,
            timeout_seconds=args.timeout_seconds,
            progress_min_bytes=args.progress_min_bytes,
        )
    except (credentials.CredentialsError, origins.OriginError, fetch.FetchError) as exc:
        print(f"minifield fetch-inputs: {exc}", file=sys.stderr)
        return 2
    try:
        records = fetch.fetch_inputs(recipe.data, args.dest, settings)
    except fetch.FetchError as exc:
        print(f"minifield fetch-inputs: {settings.credentials.redact(str(exc))}", file=sys.stderr)
        return 1
    print(json.dumps({"dest": str(args.dest), "inputs": records}, indent=2, sort_keys=True))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "fetch-inputs",
        help="fetch, verify and place the remote (url) inputs of a recipe",
        description=(
            "Download every remote input of the recipe from allowed origins into a "
            "content-addressed cache (CACHE/sha256/<hash>), verifying size and sha256 while "
            "streaming, and place each in DEST under its name."
        ),
    )
    parser.add_argument("--job", type=Path, required=True, help="recipe file (JSON or YAML)")
    parser.add_argument("--dest", type=Path, required=True, help="directory to place inputs in")
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="scheme://host[:port] that may be fetched from (repeatable); nothing else is",
    )
    parser.add_argument(
        "--credentials-file",
        type=Path,
        help='owner-only (0600) JSON {"<origin>": {"bearer_token": "..."}}',
    )
    parser.add_argument(
        "--cache", type=Path, default=Path("work/cache"), help="cache directory (work/cache)"
    )
    parser.add_argument("--ca-bundle", type=Path, help="PEM file of CAs to trust for https")
    parser.add_argument(
        "--allow-insecure-loopback",
        action="store_true",
        help="allow plain http to listed loopback origins (testing only)",
    )
    parser.add_argument("--max-attempts", type=bounded_int(1, 100), default=4)
    parser.add_argument("--backoff-seconds", type=bounded_float(0, 3600), default=0.5)
    parser.add_argument("--timeout-seconds", type=bounded_float(0, 86400, above=True), default=60.0)
    parser.add_argument(
        "--progress-min-bytes",
        type=bounded_int(0, 2**53 - 1),
        default=8 << 20,
        help="show progress on stderr for files at least this large (8 MiB)",
    )
    parser.set_defaults(func=run)
