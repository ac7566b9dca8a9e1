"""A custom reward in verl's signature for the end-to-end tests: any spread will do."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(sum(map(ord, solution_str)) % 2), "length": float(len(solution_str))}
