"""The router's own HTTP stack, apart from the gateway logic it carries: the front protocol serving the
two OpenAI POST routes (`front`, `fast_path`), the pooled worker client (`worker_http`) and the calls
to workers with their failures classified (`upstream`)."""
