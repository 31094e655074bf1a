"""``minifield store``: publish, activate, roll back and inspect artifacts in the publication store.

Exit codes: 0 success; 1 refused (a check failed: the reasons are printed, the
pointer is unchanged; a refused publication stores nothing); 2 bad request
(unknown id, unreadable input, incoherent provenance); 3 the store is locked by
another writer past ``--lock-timeout``; 5 I/O failure (the store's disk is full, over
quota, read-only or failing: the file is named, the store is unchanged; retry once there
is room).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from .. import atomic
from .. import store as stores
from ..tracking.connection import TrackingError

EXIT_REFUSED, EXIT_BAD_REQUEST, EXIT_LOCKED, EXIT_IO = 1, 2, 3, 5


def default_store_dir(config: Path) -> Path:
    """``store.dir`` from the workflow config when it exists, else ``results/store``."""
    if config.is_file():
        try:
            document = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            document = {}
        directory = (document.get("store") or {}).get("dir") if isinstance(document, dict) else None
        if directory:
            return Path(directory)
    return Path(stores.DEFAULT_DIR)


def _print(value) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _mirror(config: Path):
    """The model-registry mirror when ``tracking`` is enabled in the config (else None)."""
    from ..tracking import registry

    return registry.mirror_for(config)


def _report_mirror(store) -> None:
    report = store.mirror_report
    if report is not None and not report["ok"]:
        print(
            f"minifield store: warning: the model registry was not updated ({report['error']}); "
            "the store is unchanged by this and stays the source of truth; "
            "`minifield store verify ID` shows the disagreement",
            file=sys.stderr,
        )


def _kept(args, root: Path) -> str:
    """What an action that did not go through left as it was."""
    if args.action == "publish":
        return "nothing published"
    return f"{root / stores.POINTER} unchanged"


def run(args) -> int:
    root = args.store if args.store is not None else default_store_dir(args.config)
    try:
        mirror = _mirror(args.config)
    except ValueError as exc:  # the tracking settings of the config are unusable
        print(f"minifield store: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    store = stores.Store(
        root, lock_timeout=None if args.lock_timeout < 0 else args.lock_timeout, mirror=mirror
    )
    try:
        if args.action == "publish":
            content_id, created = store.publish(
                args.export_dir,
                recipe_json=args.recipe,
                train_result=args.train_result,
                metrics=args.metrics,
                proof=args.proof,
                no_proof=args.no_proof,
            )
            print(
                f"minifield store: {'published' if created else 'already published'} {content_id} "
                f"in {root} (not activated)",
                file=sys.stderr,
            )
            _report_mirror(store)
            print(content_id)
        elif args.action in ("activate", "rollback"):
            report = store.activate(args.id) if args.action == "activate" else store.rollback()
            pointer = report["pointer"]
            print(
                f"minifield store: {args.action}: current {pointer['current']} "
                f"(previous {pointer['previous']})"
                + ("" if report["changed"] else "; it was already current, pointer unchanged"),
                file=sys.stderr,
            )
            _print(
                {
                    "action": args.action,
                    "changed": report["changed"],
                    "current": pointer["current"],
                    "previous": pointer["previous"],
                    "reevaluation": report["reevaluation"],
                    "acceptance": report["acceptance"],
                    "registry": store.mirror_report,
                }
            )
            _report_mirror(store)
        elif args.action == "verify":
            report = store.check(args.id)
            if mirror is not None:
                disagreements = mirror.disagreements(store, args.id)
                report["registry"] = {"agrees": not disagreements, "disagreements": disagreements}
                _print(report)
                if disagreements:
                    print(
                        f"minifield store: verify {args.id}: the model registry disagrees "
                        "with the store:",
                        file=sys.stderr,
                    )
                    for line in disagreements:
                        print(f"  - {line}", file=sys.stderr)
                    return EXIT_REFUSED
            else:
                _print(report)
        elif args.action == "show":
            if args.id:
                _print({"content_id": args.id, "manifest": store.manifest(args.id)})
            else:
                _print({"store": str(root), **store.read_pointer()})
        elif args.action == "list":
            _print(store.list())
        return 0
    except stores.Refused as exc:
        what = f" {exc.content_id}" if exc.content_id else ""
        print(
            f"minifield store: {args.action}{what} refused; {_kept(args, root)}:", file=sys.stderr
        )
        for reason in exc.reasons:
            print(f"  - {reason}", file=sys.stderr)
        return EXIT_REFUSED
    except stores.LockTimeout as exc:
        print(f"minifield store: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except (stores.StoreError, OSError, ValueError) as exc:
        if atomic.is_io_failure(exc):  # the disk, not the request: the same request can succeed
            print(
                f"minifield store: {args.action}: I/O failure: {exc}; {_kept(args, root)}",
                file=sys.stderr,
            )
            return EXIT_IO
        print(f"minifield store: {args.action}: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except TrackingError as exc:  # verify could not ask the registry
        print(f"minifield store: {args.action}: model registry: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def register(sub) -> None:
    parser = sub.add_parser(
        "store",
        help="publication store: publish, activate, rollback, show, list, verify",
        description=(
            "A content-addressed, single-writer local store. Publishing never activates; "
            "activation re-checks everything and re-runs acceptance before moving active.json. "
            "Exit: 0 ok, 1 refused, 2 bad request, 3 locked."
        ),
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"store directory (default: store.dir of --config, else {stores.DEFAULT_DIR})",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("config/config.yaml"),
        help="workflow config to read store.dir from when --store is not given",
    )
    parser.add_argument(
        "--lock-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a writer waits for the store lock (0: fail at once, negative: forever)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    publish = actions.add_parser(
        "publish", help="publish an export directory (prints the content id)"
    )
    publish.add_argument("export_dir", type=Path, metavar="EXPORT_DIR")
    publish.add_argument("--recipe", type=Path, help="validated recipe (recipe.json) of the run")
    publish.add_argument("--train-result", type=Path, help="train result.json of the run")
    publish.add_argument(
        "--metrics", type=Path, help="evaluation metrics.json (declared validation)"
    )
    proof = publish.add_mutually_exclusive_group()
    proof.add_argument("--proof", type=Path, help="recovery proof.json of the computation")
    proof.add_argument(
        "--no-proof",
        metavar="REASON",
        help="publish without a recovery proof, saying why (the artifact cannot be activated)",
    )

    activate = actions.add_parser("activate", help="check an artifact and make it current")
    activate.add_argument("id", metavar="ID")
    actions.add_parser("rollback", help="re-activate the previous artifact (same checks)")
    show = actions.add_parser("show", help="the pointer, or the manifest of ID")
    show.add_argument("id", nargs="?", metavar="ID")
    actions.add_parser("list", help="every published artifact and whether it is current/previous")
    verify = actions.add_parser("verify", help="run every activation check without activating")
    verify.add_argument("id", metavar="ID")
    parser.set_defaults(func=run)
