"""Reading inputs: YAML specs (with positions and limits) into spec.tree dataclasses, and JSON files with locations."""
