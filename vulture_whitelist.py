"""Names vulture cannot see used, each with where it is used (reviewed; `tests/test_lint.py`
runs `vulture` with this file, settings in pyproject.toml `[tool.vulture]`).

Vulture reads Python only: a name used from the Snakemake rules (``workflow/rules/*.smk``,
the ``Snakefile``), by Python itself, by a library through a protocol, or only by the tests
is listed here. A name that is simply unused is removed, not listed.
"""

# the module-level __getattr__ of the package: Python calls it (lazy minifield.run/validate)
_.__getattr__
# model.greedy_generate, the one-prompt greedy form: called by the tests and documented
# (docs/model.md); the library calls generate_batch
_.greedy_generate
# an exception's cause, set by hand in attempt/checkpoint_writer.py: read by tracebacks
_.__cause__
# requests.Session.trust_env, set in inputs/fetch.py: read by requests (no proxies from env)
_.trust_env
# tokenizers' Tokenizer.pre_tokenizer, set in hf/directory.py
_.pre_tokenizer
# the JAX pytree protocol of models/llama.py: called by jax.tree_util
_.tree_flatten
# jsonschema's format checker registers recipe._is_date_time by its decorator
_._is_date_time
# called by name through jinja2's call_method in data/chat_template.py
_._render_body
# read by jinja2's sandbox (which operators it routes to call_binop) in chat_template.py
_.intercepted_binops
# called by the code data/template_sandbox.py's rewrite makes a template
# compile to (environment.bounded_concat, environment.bounded_add)
_.bounded_concat
_.bounded_add
# jinja2.visitor.NodeTransformer dispatches visit_<node class> in template_sandbox.py
_.visit_For
_.visit_Concat
_.visit_Add

# used from workflow/rules/common.smk
_.load_computations
_.input_paths
_.fetched_roots
_.for_examples
_.for_source
_.for_quantized_base
_.require_valid
_.refusal_lines
# used from workflow/rules/two_stage_common.smk
_.load_links
_.register_stage2

# used by benchmarks/hf_load.py in the code it runs in a child process (a string)
_.fp32_bytes
# used only by the tests: tests/test_state_and_checkpoint.py checks the per-part hashes
_.part_hashes
# strategies/two_stage/demo_data.py: made the shipped corpus once, by hand (its docstring
# says so); no command calls it. Decided with write_corpus below by the strategies split
_.stdlib_documents

# removed by the strategies split
_._read_json
_.write_corpus
_.STAGES
# lm-eval's model interface (harness/model.py MinifieldLM): called by lm_eval's evaluator
_.tokenizer_name
_.apply_chat_template
_._loglikelihood_tokens
_.loglikelihood_rolling
_.generate_until
# pipeline/reference_logprobs.digest: the reference directory's address for the Snakemake rule
# that computes the reference log-probabilities (workflow/rules, the chain work), and the tests
_.digest
# pipeline/chains: the reference link's input functions, called from workflow/rules (chains_common.smk, reference.smk)
_.link_reference
_.reference_input_files
# benchmarks/device_check/child.py: the step sections, looked up by module and function name
_.step_125m
_.step_350m
_.determinism_cost
# pipeline/host.py: called when the workflow is parsed (workflow/rules/common.smk)
_.io_counters_as_missing_where_partial
