"""What every model family is built from: primitives, attention, the layer stack."""
