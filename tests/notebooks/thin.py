"""The shape every committed notebook of notebooks/ keeps (explore.ipynb's widget callbacks excepted: its test has
its own rule for them)."""
import nbformat


def thin_code_cells(path):
    """The code cells of the notebook at `path`, after asserting that it is thin: a markdown cell first, the first
    code cell tagged `parameters`, outputs and execution counts stripped, and no def / class / for / while line (the
    logic lives in ds4lib; a notebook calls it)."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown" and "parameters" in code[0].metadata.get("tags", [])
    assert all(not c.outputs and c.execution_count is None for c in code), "commit the notebook with outputs stripped"
    for c in code:
        for line in c.source.splitlines():
            assert not line.lstrip().startswith(("def ", "class ", "for ", "while ")), line
    return code
