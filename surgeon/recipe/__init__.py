"""A recipe from YAML to export: schema.py validates the file (errors at file:line, through
yaml_lines.py), layer_spec.py reads layer lists, step.py is the contract every operation implements,
plan.py checks every step on the meta device before any weight is read, patient.py is the model
under surgery with its provenance, and run.py applies the steps and exports."""
