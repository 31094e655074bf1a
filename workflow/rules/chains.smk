# Chained computations (config "chains" and "two_stage", docs/two-stage.md): a downstream
# recipe starts from an upstream computation's export, so its computation digest is known
# only once the upstream one has trained. One checkpoint per kind of link, the same rule:
# its output path is known when parsing (upstream digest / digest of the recipe as
# written); after it ran, the concrete recipe is registered under its own digest and goes
# through the usual rules (validate ... evaluate, publish, report).
for _kind in chains.KINDS.values():

    checkpoint:
        name:
            _kind.rule
        input:
            written=written_recipe(_kind),
            upstream_recipe="results/computations/{a}/recipe.json",
            upstream_metrics="results/computations/{a}/eval/metrics.json",
            product="results/computations/{a}/train/export",
        output:
            recipe=f"{_kind.directory}/{{a}}/{{b}}/{_kind.recipe_file}",
            root=directory(f"{_kind.directory}/{{a}}/{{b}}/inputs"),
        log:
            f"logs/{_kind.rule}/{{a}}-{{b}}.log",
        conda:
            "../../envs/minifield.yaml"
        params:
            kind=_kind.key,
            input_root=INPUT_ROOT,
        script:
            "../scripts/chain_link.py"
