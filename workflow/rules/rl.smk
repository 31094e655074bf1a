# A chain into a grpo recipe (docs/grpo.md "In a chain"): the upstream export and the grpo
# computation's export on the same prompts, scored by the recipe's rewards, and the recipe's
# checks. Input functions: chains_common.smk.


rule rl_before_after:
    input:
        unpack(rl_before_after_inputs),
    output:
        record="results/chains/{a}/{b}/rl-before-after.json",
        table=report(
            "results/chains/{a}/{b}/report/rl-before-after.html",
            caption="../report/rl-before-after.rst",
            category="9. RL",
            labels={"upstream": "{a}", "grpo recipe as written": "{b}"},
        ),
    log:
        "logs/rl_before_after/{a}-{b}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        reward_files=rl_reward_files,
    script:
        "../scripts/rl_before_after.py"
