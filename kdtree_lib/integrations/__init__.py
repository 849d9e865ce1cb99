"""Drop-ins for serving stacks: the same functions, arguments and outputs as theirs, computed by kdtree_lib.

- `sglang`: SGLang's DDTree tree build (`build_ddtree_tree`, `build_eagle_tree_format`) and `install()`.
"""
