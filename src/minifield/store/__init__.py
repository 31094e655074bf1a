"""The publication store: content-addressed artifacts and a gated, reversible ``active.json``.

Layout of a store directory::

    DIR/artifacts/<content-id>/manifest.json   provenance, declared validation, recipe, payload list
    DIR/artifacts/<content-id>/model.json      the exported model (payload) ...
    DIR/artifacts/<content-id>/weights/*.npy   ... and its weights (payload)
    DIR/artifacts/<content-id>/evidence/proof.json   copy of the recovery proof (payload)
    DIR/active.json                            {current, previous, history}
    DIR/.lock                                  single-writer lock (minifield.supervision.locks)

Modules, one concept each:

- :mod:`.layout` — file names and what a payload is;
- :mod:`.manifest` — building the manifest, whose sha256 is the content id;
- :mod:`.gate` — the activation checks, one function each;
- :mod:`.pointer` — reading and moving ``active.json``;
- :mod:`.store` — :class:`Store`: a store directory, its lock, publish/activate/rollback;
- :mod:`.rules` — the pipeline's ``publish`` and ``activate`` rules.

Publishing never activates, and refuses a recovery proof that does not qualify the
computation. Activation (and rollback, which is an activation of ``previous``)
trusts nothing recorded at publication time without checking it again (see
:mod:`.gate`); only when every check passes does it replace ``active.json``
atomically; any failure leaves it byte-for-byte as it was.

This is a trusted, single-writer local store: checksums detect accidental
corruption, they do not authenticate an adversarial writer, and a boolean
validation record is not a signed attestation.
"""

from .errors import LockTimeout, Refused, StoreError
from .layout import DEFAULT_DIR, FORMAT, MANIFEST, POINTER, POINTER_FORMAT
from .rules import activate_publication, publish_computation
from .store import Store

__all__ = [
    "DEFAULT_DIR",
    "FORMAT",
    "MANIFEST",
    "POINTER",
    "POINTER_FORMAT",
    "LockTimeout",
    "Refused",
    "Store",
    "StoreError",
    "activate_publication",
    "publish_computation",
]
