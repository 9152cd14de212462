"""Mutation testing of the production code: how much of what a bug does the suite kills.

cosmic-ray enumerates and applies the mutants (its operators, parse trees and session database);
this package chooses them, runs a fast kill command against each and writes the report. Two kinds
of mutant, run the same way: cosmic-ray's operators over the targets (config.toml) and the
failure catalogue, hand-written patches of the kernels (catalogue.toml). ``nox -s
mutation`` runs it (``python -m maintainer.mutation run``); docs/mutation.md is its report.
"""
