//! Listing every ResourceClaim of the cluster without letting one claim spoil the list.
//!
//! The API server stores what it accepts, and it accepts opaque parameters that serde_json refuses to decode
//! into Rust strings and values: a lone UTF-16 surrogate (`"\ud800"`, valid JSON, not valid Unicode) or a
//! value nested deeper than serde_json's recursion limit (128). Decoded as one typed list, a single such claim
//! in any namespace, for any driver, fails the whole list — and with it every check that reads all claims on
//! every node. So the list is decoded in two steps: the page into its items kept raw (serde_json skips raw
//! values without decoding strings and without recursing), then each item on its own. An item that does not
//! decode becomes an [`Unreadable`] entry naming the claim and the cause in a user's words; the rest are read.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::ListParams;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::JSON_NESTING_LIMIT;

/// Claims per page: large clusters get several smaller responses instead of one huge one.
const PAGE_SIZE: u32 = 500;

/// The longest cause an [`Unreadable`] keeps (serde_json's message with its position; never the claim's text).
const MAX_CAUSE: usize = 300;

/// Every claim of a list, and those that could not be decoded.
#[derive(Clone, Debug, Default)]
pub struct ClaimList {
    pub claims: Vec<ResourceClaim>,
    pub unreadable: Vec<Unreadable>,
}

/// A claim the list holds but that does not decode, named as far as its metadata allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
    /// Why, in a user's words (a lone surrogate, too deep a nesting, or serde_json's own message, bounded).
    pub cause: String,
}

impl Unreadable {
    /// `namespace/name`, or what is known of it.
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.namespace.as_deref().unwrap_or("?"),
            self.name.as_deref().unwrap_or("?")
        )
    }
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResourceClaim {} cannot be read: {}", self.key(), self.cause)
    }
}

/// One page of a list, items kept raw.
#[derive(Deserialize)]
struct RawPage<'a> {
    #[serde(default, borrow)]
    items: Vec<&'a RawValue>,
    #[serde(default)]
    metadata: PageMeta,
}

#[derive(Default, Deserialize)]
struct PageMeta {
    #[serde(default, rename = "continue")]
    continue_: Option<String>,
}

/// Only the names of an item, everything else skipped undecoded (names are validated DNS labels, so they
/// decode whenever the item is JSON at all).
#[derive(Deserialize)]
struct NamesOnly {
    #[serde(default)]
    metadata: Names,
}

#[derive(Default, Deserialize)]
struct Names {
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
}

/// Decodes one page of a ResourceClaim list: its claims, those that do not decode, and the continue token.
pub fn decode_page(body: &str) -> Result<(ClaimList, Option<String>), serde_json::Error> {
    let page: RawPage<'_> = serde_json::from_str(body)?;
    let mut list = ClaimList::default();
    for item in page.items {
        match serde_json::from_str::<ResourceClaim>(item.get()) {
            Ok(claim) => list.claims.push(claim),
            Err(e) => {
                let names = serde_json::from_str::<NamesOnly>(item.get())
                    .map(|n| n.metadata)
                    .unwrap_or_default();
                list.unreadable.push(Unreadable {
                    namespace: names.namespace,
                    name: names.name,
                    uid: names.uid,
                    cause: cause_in_words(&e),
                });
            }
        }
    }
    let token = page.metadata.continue_.filter(|c| !c.is_empty());
    Ok((list, token))
}

/// serde_json's error, said as what is wrong with the claim.
pub fn cause_in_words(error: &serde_json::Error) -> String {
    let text = error.to_string();
    if text.contains("recursion limit exceeded") {
        return format!(
            "a value in it nests deeper than {JSON_NESTING_LIMIT} levels (its opaque configuration, most likely); \
             no configuration tessera reads nests more than 4"
        );
    }
    if text.contains("surrogate") || text.contains("hex escape") {
        return "a string in it holds a lone UTF-16 surrogate escape (such as \\ud800), which is valid JSON \
                but not valid Unicode; replace or remove that string"
            .to_string();
    }
    let mut text = format!("it does not decode as a ResourceClaim: {text}");
    if text.len() > MAX_CAUSE {
        let mut end = MAX_CAUSE;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Every ResourceClaim of the cluster, paged; claims that do not decode are returned as [`Unreadable`].
pub async fn list_all(client: &kube::Client) -> Result<ClaimList, kube::Error> {
    let request = kube::core::Request::new("/apis/resource.k8s.io/v1/resourceclaims");
    let mut params = ListParams::default().limit(PAGE_SIZE);
    let mut all = ClaimList::default();
    loop {
        let http = request.list(&params).map_err(kube::Error::BuildRequest)?;
        let body = client.request_text(http).await?;
        let (page, token) = decode_page(&body).map_err(kube::Error::SerdeError)?;
        all.claims.extend(page.claims);
        all.unreadable.extend(page.unreadable);
        match token {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(all),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list page of the given raw items.
    fn page(items: &[String], token: Option<&str>) -> String {
        let meta = match token {
            Some(t) => format!(r#"{{"continue":"{t}","resourceVersion":"7"}}"#),
            None => r#"{"resourceVersion":"7"}"#.to_string(),
        };
        format!(
            r#"{{"kind":"ResourceClaimList","apiVersion":"resource.k8s.io/v1","metadata":{meta},"items":[{}]}}"#,
            items.join(",")
        )
    }

    /// A claim whose spec holds `parameters` as an opaque config (raw JSON).
    fn claim_with_parameters(namespace: &str, name: &str, parameters: &str) -> String {
        format!(
            r#"{{"metadata":{{"namespace":"{namespace}","name":"{name}","uid":"uid-{name}"}},
               "spec":{{"devices":{{"requests":[{{"name":"r","exactly":{{"deviceClassName":"gpu.tessera.dev"}}}}],
               "config":[{{"opaque":{{"driver":"other.example.com","parameters":{parameters}}}}}]}}}}}}"#
        )
    }

    fn nested(levels: usize) -> String {
        format!("{}{}", "[".repeat(levels), "]".repeat(levels))
    }

    #[test]
    fn one_claim_with_a_lone_surrogate_or_deep_nesting_leaves_the_others_readable() {
        let body = page(
            &[
                claim_with_parameters("a", "fine", r#"{"x":1}"#),
                claim_with_parameters("b", "surrogate", r#"{"x":"\ud800"}"#),
                claim_with_parameters("c", "deep", &nested(1000)),
                claim_with_parameters("d", "also-fine", r#"{}"#),
            ],
            None,
        );
        let (list, token) = decode_page(&body).unwrap();
        assert_eq!(token, None);
        let names: Vec<_> = list
            .claims
            .iter()
            .map(|c| c.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["fine", "also-fine"]);
        assert_eq!(list.unreadable.len(), 2);
        assert_eq!(list.unreadable[0].key(), "b/surrogate");
        assert_eq!(list.unreadable[0].uid.as_deref(), Some("uid-surrogate"));
        assert!(
            list.unreadable[0].cause.contains("lone UTF-16 surrogate"),
            "{}",
            list.unreadable[0].cause
        );
        assert_eq!(list.unreadable[1].key(), "c/deep");
        assert!(
            list.unreadable[1].cause.contains("deeper than 128"),
            "{}",
            list.unreadable[1].cause
        );
    }

    #[test]
    fn the_continue_token_is_returned_and_an_empty_one_ends_the_list() {
        let (_, token) = decode_page(&page(&[], Some("abc"))).unwrap();
        assert_eq!(token.as_deref(), Some("abc"));
        let (_, token) = decode_page(&page(&[], Some(""))).unwrap();
        assert_eq!(token, None);
    }

    #[test]
    fn a_cause_never_carries_more_than_its_bound() {
        let err = serde_json::from_str::<ResourceClaim>(&format!(
            r#"{{"metadata":{{"name":{}}}}}"#,
            "1".repeat(5000)
        ))
        .unwrap_err();
        let cause = cause_in_words(&err);
        assert!(cause.chars().count() <= MAX_CAUSE + 1, "{cause}");
    }

    #[test]
    fn a_page_that_is_not_a_list_is_an_error() {
        assert!(decode_page("not json").is_err());
    }
}
