"""The recovery proof: evidence that an interrupted and resumed run is the same computation."""
