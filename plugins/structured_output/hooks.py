"""Registers the built-in structured-output backends (lazily: neither library is imported until chosen)."""

from patchbay import hookimpl


@hookimpl
def register_structured_output_backends(register):
    register(
        "xgrammar",
        "patchbay.plugins.structured_output.xgrammar_backend:XGrammarBackend",
        description="xgrammar: pushdown automata with precomputed token masks; JSON schema, regex, choice, GBNF",
    )
    register(
        "llguidance",
        "patchbay.plugins.structured_output.llguidance_backend:LLGuidanceBackend",
        description="llguidance: Earley parser over a lazy lexer; JSON schema, regex, choice, GBNF (as Lark)",
    )
