# A mixture's training sources are prepared each on its own, addressed by the source digest
# (the file, how it is read, the tokenizer and packing settings): recipes that mix one
# source with different others prepare it once. The examples of a computation then take
# those rows as they are and add the held-out splits.
rule prepare_source:
    input:
        unpack(source_inputs),
    output:
        f"{SOURCES_DIR}/{{sdigest}}/manifest.json",
    log:
        "logs/prepare_source/{sdigest}.log",
    benchmark:
        "results/benchmarks/prepare_source/{sdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=source_input_root,
        source=source_name,
    script:
        "../scripts/prepare_source.py"


# A quantized base (model.lora.base_quantization) is made once per quantized-base digest (the
# base's pins and the quantization settings), from the base a computation's examples hold, on
# the CPU, and shared by every computation that quantizes the same base the same way.
rule quantize_base:
    input:
        unpack(quantized_base_inputs),
    output:
        f"{QUANTIZED_DIR}/{{qdigest}}/manifest.json",
    log:
        "logs/quantize_base/{qdigest}.log",
    benchmark:
        "results/benchmarks/quantize_base/{qdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/quantize_base.py"


rule prepare:
    input:
        recipe=examples_recipe,
        inputs=examples_inputs_record,
        fetched=examples_fetched_root,
        sources=examples_sources,
    output:
        "results/examples/{edigest}/manifest.json",
    log:
        "logs/prepare/{edigest}.log",
    benchmark:
        "results/benchmarks/prepare/{edigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=examples_input_root,
        sources_root=SOURCES_DIR,
    script:
        "../scripts/prepare.py"
