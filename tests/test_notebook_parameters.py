"""Every name a notebook's `parameters` cell assigns is a parameter papermill's own inspection lists, so
`--set NN.name=value` reaches it and papermill parses the cell without a warning (a `=` inside a comment, as
in "# runs TP=8", makes papermill drop the whole line)."""
import ast

import nbformat
import pytest

from kdtree_lib.notebooks import declared_parameters, discover

NOTEBOOKS = discover()


def assigned_names(path) -> list[str]:
    """The names the notebook's parameters cell assigns at top level, read by Python's parser."""
    notebook = nbformat.read(str(path), as_version=4)
    cells = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name}: expected one cell tagged 'parameters', found {len(cells)}"
    names = []
    for statement in ast.parse(cells[0].source).body:
        targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
        names += [target.id for target in targets if isinstance(target, ast.Name)]
    return names


def missing_from_inspection(path) -> list[str]:
    return [name for name in assigned_names(path) if name not in declared_parameters(path)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_papermill_lists_every_declared_parameter(path):
    assert assigned_names(path), f"{path.name}: the parameters cell assigns nothing"
    assert missing_from_inspection(path) == []


def test_a_line_papermill_cannot_parse_is_caught(tmp_path):
    path = tmp_path / "99_demo.ipynb"
    cell = nbformat.v4.new_code_cell("budget = 8    # nodes\ntp_degree = 8  # the box runs TP=8\n",
                                     metadata={"tags": ["parameters"]})
    kernel = {"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}}
    nbformat.write(nbformat.v4.new_notebook(cells=[cell], metadata=kernel), str(path))
    assert missing_from_inspection(path) == ["tp_degree"]
