import datasets
import evaluate


class CharLenRatio(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="d", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("string"),
                                                               "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        return {"char_len_ratio": sum(map(len, predictions)) / sum(map(len, references))}
