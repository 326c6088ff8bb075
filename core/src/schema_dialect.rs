//! What each provider accepts of a JSON Schema for structured output, and the
//! projection of our findings schemas into that subset.
//!
//! Providers accept different subsets: OpenAI's strict structured outputs want
//! `additionalProperties: false` and every property required on every object, and take
//! `pattern`/`format`, numeric ranges and array counts on base models only (no string
//! lengths at all); Anthropic's reject numeric ranges, string lengths, `maxItems` and a
//! `minItems` other than 0 or 1, and want `additionalProperties: false` everywhere;
//! OpenAI-compatible servers (vLLM, Ollama, LiteLLM) vary. What goes out is the
//! projection for the configured dialect; the full schema (lengths, ranges, enums) is
//! always enforced by our own validator on the answer.
//!
//! [`violations`] states a dialect's rules as the provider's error would, so the
//! simulated provider can refuse a schema the real one would refuse.

use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SchemaDialect {
    /// The schema as it is (a server that takes all of JSON Schema).
    Full,
    /// OpenAI structured outputs, base models.
    OpenAi,
    /// OpenAI structured outputs, fine-tuned models: no ranges, counts or patterns.
    OpenAiFineTuned,
    /// Anthropic structured outputs.
    Anthropic,
    /// Structure only: types, properties, required, items, enums,
    /// `additionalProperties`, with every object closed and every property required
    /// (optional ones nullable), as OpenAI's strict mode insists. Accepted by every
    /// provider above and by vLLM, Ollama and LiteLLM; the default.
    #[default]
    Portable,
}

/// Keys that describe the document, not the data; no provider needs them.
const META: [&str; 4] = ["$schema", "$id", "title", "$comment"];

/// The keywords [`SchemaDialect::Portable`] keeps.
const PORTABLE: [&str; 9] =
    ["type", "properties", "required", "items", "enum", "additionalProperties", "description", "anyOf", "const"];

/// OpenAI: string lengths are not among the supported keywords on any model.
const OPENAI_UNSUPPORTED: [&str; 2] = ["minLength", "maxLength"];

const OPENAI_FINE_TUNED_UNSUPPORTED: [&str; 11] = [
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
];

const ANTHROPIC_UNSUPPORTED: [&str; 11] = [
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
];

impl SchemaDialect {
    pub const ALL: [SchemaDialect; 5] = [
        SchemaDialect::Full,
        SchemaDialect::OpenAi,
        SchemaDialect::OpenAiFineTuned,
        SchemaDialect::Anthropic,
        SchemaDialect::Portable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SchemaDialect::Full => "full",
            SchemaDialect::OpenAi => "openai",
            SchemaDialect::OpenAiFineTuned => "openai-fine-tuned",
            SchemaDialect::Anthropic => "anthropic",
            SchemaDialect::Portable => "portable",
        }
    }

    /// Whether a keyword (other than a structural one) may appear with `value`.
    fn allows(self, keyword: &str, value: &Value) -> bool {
        match self {
            SchemaDialect::Full => true,
            SchemaDialect::OpenAi => !OPENAI_UNSUPPORTED.contains(&keyword),
            SchemaDialect::OpenAiFineTuned => !OPENAI_FINE_TUNED_UNSUPPORTED.contains(&keyword),
            SchemaDialect::Anthropic => {
                !ANTHROPIC_UNSUPPORTED.contains(&keyword)
                    && (keyword != "minItems" || value.as_u64().is_some_and(|n| n <= 1))
            }
            SchemaDialect::Portable => PORTABLE.contains(&keyword),
        }
    }

    /// Whether every object must say `additionalProperties: false`.
    fn closed_objects(self) -> bool {
        self != SchemaDialect::Full
    }

    /// Whether every property must be listed in `required` (optional ones nullable).
    fn all_required(self) -> bool {
        matches!(self, SchemaDialect::OpenAi | SchemaDialect::OpenAiFineTuned | SchemaDialect::Portable)
    }
}

impl std::str::FromStr for SchemaDialect {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        SchemaDialect::ALL.into_iter().find(|d| d.as_str() == s).ok_or(())
    }
}

impl std::fmt::Display for SchemaDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `schema` as `dialect` accepts it: meta keys dropped everywhere, keywords the
/// dialect refuses dropped, objects closed and properties made required (optional ones
/// nullable) where the dialect wants that.
pub fn project(schema: &Value, dialect: SchemaDialect) -> Value {
    let mut out = project_node(schema, dialect);
    if let Some(o) = out.as_object_mut() {
        for k in META {
            o.remove(k);
        }
    }
    out
}

fn project_node(node: &Value, d: SchemaDialect) -> Value {
    let Some(obj) = node.as_object() else { return node.clone() };
    let mut out = Map::new();
    for (k, v) in obj {
        let v = match k.as_str() {
            "properties" | "$defs" | "definitions" => Value::Object(
                v.as_object().into_iter().flatten().map(|(name, s)| (name.clone(), project_node(s, d))).collect(),
            ),
            "items" => project_node(v, d),
            "anyOf" | "allOf" | "oneOf" => {
                Value::Array(v.as_array().into_iter().flatten().map(|s| project_node(s, d)).collect())
            }
            "additionalProperties" | "type" | "required" => v.clone(),
            _ if META.contains(&k.as_str()) => continue,
            _ if !d.allows(k, v) => continue,
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    if out.contains_key("properties") {
        if d.closed_objects() {
            out.insert("additionalProperties".into(), Value::Bool(false));
        }
        if d.all_required() {
            let required: Vec<String> = out
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            let names: Vec<String> =
                out["properties"].as_object().map(|p| p.keys().cloned().collect()).unwrap_or_default();
            if let Some(props) = out.get_mut("properties").and_then(Value::as_object_mut) {
                for name in names.iter().filter(|n| !required.contains(n)) {
                    if let Some(Value::Object(p)) = props.get_mut(name) {
                        nullable(p);
                    }
                }
            }
            out.insert("required".into(), Value::Array(names.into_iter().map(Value::String).collect()));
        }
    }
    Value::Object(out)
}

/// An optional property made required: it may be `null` instead (an `enum` of it
/// lists `null` too, or a `null` answer would fail it).
fn nullable(p: &mut Map<String, Value>) {
    match p.get_mut("type") {
        Some(Value::String(t)) => {
            let t = t.clone();
            p.insert("type".into(), serde_json::json!([t, "null"]));
        }
        Some(Value::Array(ts)) if !ts.iter().any(|t| t == "null") => ts.push("null".into()),
        _ => {}
    }
    if let Some(Value::Array(values)) = p.get_mut("enum")
        && !values.contains(&Value::Null)
    {
        values.push(Value::Null);
    }
}

/// What `dialect`'s provider would refuse in `schema`, phrased as its error would be
/// (names of keywords and properties of our schema, never content). Empty: accepted.
pub fn violations(schema: &Value, dialect: SchemaDialect) -> Vec<String> {
    let mut out = Vec::new();
    check_node(schema, dialect, &mut Vec::new(), &mut out);
    out
}

fn check_node(node: &Value, d: SchemaDialect, path: &mut Vec<String>, out: &mut Vec<String>) {
    let Some(obj) = node.as_object() else { return };
    let context = format!("context=({})", path.iter().map(|p| format!("'{p}'")).collect::<Vec<_>>().join(", "));
    let ty = obj.get("type").and_then(Value::as_str).unwrap_or("any");
    for (k, v) in obj {
        match k.as_str() {
            "properties" | "$defs" | "definitions" => {
                for (name, s) in v.as_object().into_iter().flatten() {
                    path.extend([k.clone(), name.clone()]);
                    check_node(s, d, path, out);
                    path.truncate(path.len() - 2);
                }
            }
            "items" => {
                path.push(k.clone());
                check_node(v, d, path, out);
                path.pop();
            }
            "anyOf" | "allOf" | "oneOf" => {
                for (i, s) in v.as_array().into_iter().flatten().enumerate() {
                    path.extend([k.clone(), i.to_string()]);
                    check_node(s, d, path, out);
                    path.truncate(path.len() - 2);
                }
            }
            "type" | "required" | "additionalProperties" => {}
            _ if path.is_empty() && META.contains(&k.as_str()) => {}
            _ if !d.allows(k, v) => out.push(match d {
                SchemaDialect::Anthropic if k == "minItems" => {
                    format!("For 'array' type, 'minItems' values other than 0 or 1 are not supported ({})", context)
                }
                SchemaDialect::Anthropic => format!("For '{ty}' type, property '{k}' is not supported ({})", context),
                _ => format!("In {}, '{k}' is not permitted.", context),
            }),
            _ => {}
        }
    }
    if obj.contains_key("properties") {
        if d.closed_objects() && obj.get("additionalProperties") != Some(&Value::Bool(false)) {
            out.push(format!("In {}, 'additionalProperties' is required to be supplied and to be false.", context));
        }
        if d.all_required() {
            let required: Vec<&str> =
                obj.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
            for name in obj["properties"].as_object().into_iter().flat_map(|p| p.keys()) {
                if !required.contains(&name.as_str()) {
                    out.push(format!(
                        "In {}, 'required' is required to be supplied and to be an array including every key in properties. Missing '{name}'.",
                        context
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings;
    use serde_json::json;

    #[test]
    fn every_projection_of_every_schema_is_accepted_by_its_dialect() {
        for version in findings::known_schemas() {
            let full = findings::schema_document(version).unwrap();
            for d in SchemaDialect::ALL {
                let projected = project(full, d);
                assert_eq!(violations(&projected, d), Vec::<String>::new(), "{version} as {d}");
                // Nothing structural is lost: the same properties, required and enums.
                let findings = &projected["properties"]["findings"]["items"];
                assert_eq!(
                    findings["properties"]["severity"]["enum"],
                    full["properties"]["findings"]["items"]["properties"]["severity"]["enum"]
                );
                let item = &full["properties"]["findings"]["items"];
                let want = if d.all_required() {
                    item["properties"].as_object().unwrap().len()
                } else {
                    item["required"].as_array().unwrap().len()
                };
                assert_eq!(findings["required"].as_array().unwrap().len(), want, "{version} as {d}");
                assert!(projected.get("$schema").is_none());
            }
            // The default goes to any provider: what it sends, each of them accepts.
            let portable = project(full, SchemaDialect::Portable);
            for d in SchemaDialect::ALL {
                assert_eq!(violations(&portable, d), Vec::<String>::new(), "{version} as portable, to {d}");
            }
        }
    }

    #[test]
    fn the_full_schema_is_refused_by_the_restrictive_dialects() {
        let full = findings::schema_document(findings::LATEST_SCHEMA).unwrap();
        for d in
            [SchemaDialect::OpenAi, SchemaDialect::OpenAiFineTuned, SchemaDialect::Anthropic, SchemaDialect::Portable]
        {
            assert!(!violations(full, d).is_empty(), "{d} would take the full schema");
        }
        let anthropic = violations(full, SchemaDialect::Anthropic);
        assert!(
            anthropic.iter().any(|v| v.contains("For 'string' type, property 'maxLength' is not supported")),
            "{anthropic:?}"
        );
        assert!(anthropic.iter().any(|v| v.contains("For 'integer' type, property 'minimum' is not supported")));
    }

    #[test]
    fn strict_dialects_close_objects_and_make_optional_properties_nullable() {
        let s = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer", "minimum": 1}}, "required": ["a"]});
        assert_eq!(violations(&s, SchemaDialect::OpenAi).len(), 2, "{:?}", violations(&s, SchemaDialect::OpenAi));
        let p = project(&s, SchemaDialect::OpenAi);
        assert_eq!(p["additionalProperties"], json!(false));
        assert_eq!(p["required"], json!(["a", "b"]));
        assert_eq!(p["properties"]["b"]["type"], json!(["integer", "null"]));
        assert_eq!(p["properties"]["b"]["minimum"], json!(1), "base models take ranges");
        // An optional enum takes `null` as one of its values.
        let e = json!({"type": "object", "properties": {"s": {"type": "string", "enum": ["x"]}}});
        for d in [SchemaDialect::OpenAi, SchemaDialect::Portable] {
            assert_eq!(project(&e, d)["properties"]["s"]["enum"], json!(["x", null]), "{d}");
        }
        let ft = project(&s, SchemaDialect::OpenAiFineTuned);
        assert!(ft["properties"]["b"].get("minimum").is_none());
        // Anthropic: minItems 0 or 1 stays, anything else goes.
        let arr = json!({"type": "array", "minItems": 2, "items": {"type": "string"}});
        assert!(project(&arr, SchemaDialect::Anthropic).get("minItems").is_none());
        let one = json!({"type": "array", "minItems": 1, "items": {"type": "string"}});
        assert_eq!(project(&one, SchemaDialect::Anthropic)["minItems"], json!(1));
    }

    #[test]
    fn names_parse_and_the_default_is_portable() {
        for d in SchemaDialect::ALL {
            assert_eq!(d.as_str().parse::<SchemaDialect>(), Ok(d));
        }
        assert!("gpt".parse::<SchemaDialect>().is_err());
        assert_eq!(SchemaDialect::default(), SchemaDialect::Portable);
    }
}
