# The jinja2 templates of the generated code. This file makes the folder the package
# ``hpgen.templates`` so that importlib.resources finds it in wheels and editable installs.
