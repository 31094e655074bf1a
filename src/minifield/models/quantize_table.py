"""The quantized base's constants, without JAX: the device's dequantization
(:mod:`minifield.models.quantize`) and the host's quantizer
(:mod:`minifield.hf.quantized_base`, a light stage) read the same table."""

#: bitsandbytes' NF4 table (csrc kernels' ``nf4_dequantization_lut``; QLoRA appendix E)
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
SCHEMES = ("int8", "nf4")
NF4_BLOCK = 64
SCALE_GROUP = 256  # QLoRA's block size for the second quantization
