# minifield: recipe → validated computation → pinned inputs → examples → recovery proof
# → training → evaluation → publication → capacity.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
# before the rules: it takes recipes that need a reference out of the configured targets
include: "workflow/rules/chains_common.smk"


# Digests in paths are 16 hex characters: an unconstrained {cdigest} would also
# match names such as "abc.eval" and make rules ambiguous.
wildcard_constraints:
    cdigest="[0-9a-f]{16}",
    edigest="[0-9a-f]{16}",
    sdigest="[0-9a-f]{16}",
    qdigest="[0-9a-f]{16}",
    destination="[0-9a-f]{16}",


include: "workflow/rules/validate.smk"
include: "workflow/rules/fetch.smk"
include: "workflow/rules/inputs.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/qualify.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/publish.smk"
include: "workflow/rules/capacity.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/chains.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/rl.smk"
include: "workflow/rules/two_stage.smk"
include: "workflow/rules/tracking.smk"


rule all:
    default_target: True
    input:
        final_targets(),
        *chain_targets(),


# A stage that refused its input ended with one line in its log; the run's last lines repeat it.
onerror:
    print_refusals(log)


# What the run did, per computation: an acceptance that fails still ends at exit 0.
onsuccess:
    print_closing_summary()
