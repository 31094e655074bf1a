# Chained computations (config "chains" and "two_stage", docs/two-stage.md) and reference
# products (docs/preference.md): a downstream recipe starts from an upstream product (a
# computation's export, a reference), so its computation digest is known only once the
# product exists. One checkpoint per kind of link, the same rule: its output path is known
# when parsing (upstream digest / digest of the recipe as written); after it ran, the
# concrete recipe is registered under its own digest and goes through the usual rules
# (validate ... evaluate, publish, report).
for _kind in chains.KINDS.values():

    checkpoint:
        name:
            _kind.rule
        input:
            unpack(link_inputs(_kind)),
        output:
            recipe=f"{_kind.directory}/{{a}}/{{b}}/{_kind.recipe_file}",
            root=directory(f"{_kind.directory}/{{a}}/{{b}}/inputs"),
        log:
            f"logs/{_kind.rule}/{{a}}-{{b}}.log",
        conda:
            "../../envs/minifield.yaml"
        params:
            kind=_kind.key,
            input_root=link_input_root(_kind),
        script:
            "../scripts/chain_link.py"
