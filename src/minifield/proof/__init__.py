"""The recovery proof: evidence that an interrupted and resumed run is the same computation
(``prove``), and the one verdict on a proof document (``verdict``)."""
