//! `#[derive(Settings)]`: a service's command-line flags derived from its config struct, so
//! each setting is written once — its name, its help (the field's doc comment) and its default
//! (the struct's `Default`, which the CLI prints in `--help`).
//!
//! The derive makes a companion struct (named by `#[settings(flags = Name)]`) that clap parses
//! and serde writes back as the config's own keys: every field unset unless given, so the
//! file's and the environment's values stay underneath (defaults → file → env → flags).
//!
//! Per field:
//! - `#[settings(skip)]`: no flag (set only in the file or the environment);
//! - `#[settings(switch)]`: a `bool` given as a bare `--flag`;
//! - `#[settings(hide)]`: a flag left out of `--help` (fault hooks for tests);
//! - `#[settings(flatten = OtherFlags)]`: a nested table (`[engine]`) whose flags join these;
//! - `#[arg(...)]`: passed to clap as is (`long = "router"`, `value_name`, `env`).
//!
//! An `Option<T>` or `Vec<T>` field keeps its type; any other `T` becomes `Option<T>`.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{Attribute, Data, DeriveInput, Fields, Ident, Path, Type, parse_macro_input};

#[proc_macro_derive(Settings, attributes(settings, arg))]
pub fn derive_settings(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}

/// What one field's `#[settings(...)]` asks for.
#[derive(Default)]
struct FieldOpts {
    skip: bool,
    switch: bool,
    hide: bool,
    flatten: Option<Path>,
}

fn field_opts(attrs: &[Attribute]) -> syn::Result<FieldOpts> {
    let mut o = FieldOpts::default();
    for a in attrs.iter().filter(|a| a.path().is_ident("settings")) {
        a.parse_nested_meta(|m| {
            if m.path.is_ident("skip") {
                o.skip = true;
            } else if m.path.is_ident("switch") {
                o.switch = true;
            } else if m.path.is_ident("hide") {
                o.hide = true;
            } else if m.path.is_ident("flatten") {
                o.flatten = Some(m.value()?.parse()?);
            } else {
                return Err(m.error("expected skip, switch, hide or flatten = FlagsType"));
            }
            Ok(())
        })?;
    }
    Ok(o)
}

fn flags_name(attrs: &[Attribute]) -> syn::Result<Option<Ident>> {
    let mut name = None;
    for a in attrs.iter().filter(|a| a.path().is_ident("settings")) {
        a.parse_nested_meta(|m| {
            if m.path.is_ident("flags") {
                name = Some(m.value()?.parse()?);
                Ok(())
            } else {
                Err(m.error("expected flags = Name"))
            }
        })?;
    }
    Ok(name)
}

/// `Option` or `Vec` by the type's last path segment: those already say "maybe unset".
fn wrapper(ty: &Type) -> Option<&'static str> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    match last.ident.to_string().as_str() {
        "Option" => Some("Option"),
        "Vec" => Some("Vec"),
        _ => None,
    }
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let config = &input.ident;
    let vis = &input.vis;
    let flags = flags_name(&input.attrs)?.unwrap_or_else(|| format_ident!("{config}Flags"));
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(config, "Settings is for structs"));
    };
    let Fields::Named(named) = &data.fields else {
        return Err(syn::Error::new_spanned(config, "Settings needs named fields"));
    };
    let mut fields = Vec::new();
    let mut keys = Vec::new();
    for f in &named.named {
        let o = field_opts(&f.attrs)?;
        if o.skip {
            continue;
        }
        let name = f.ident.as_ref().expect("named fields");
        let key = name.to_string();
        let docs: Vec<&Attribute> = f.attrs.iter().filter(|a| a.path().is_ident("doc")).collect();
        let passed: Vec<&Attribute> = f.attrs.iter().filter(|a| a.path().is_ident("arg")).collect();
        let ty = &f.ty;
        if let Some(nested) = &o.flatten {
            fields.push(quote! {
                #[command(flatten)]
                pub #name: #nested,
            });
            keys.push(quote! { #nested::setting_keys(&format!("{prefix}/{}", #key), out); });
            continue;
        }
        let hide = o.hide.then(|| quote! { , hide = true });
        let (flag_ty, skip_if) = match (o.switch, wrapper(ty)) {
            (true, _) => (quote! { bool }, "std::ops::Not::not"),
            (false, Some("Vec")) => (quote! { #ty }, "Vec::is_empty"),
            (false, Some(_)) => (quote! { #ty }, "Option::is_none"),
            (false, None) => (quote! { Option<#ty> }, "Option::is_none"),
        };
        fields.push(quote! {
            #(#docs)*
            #[arg(long #hide)]
            #(#passed)*
            #[serde(skip_serializing_if = #skip_if)]
            pub #name: #flag_ty,
        });
        keys.push(quote! { out.push((#key, format!("{prefix}/{}", #key))); });
    }
    let doc = format!(
        "[`{config}`] as flags: each setting unset unless given, written back as the \
         config's own keys so the file's and the environment's values stay underneath."
    );
    Ok(quote! {
        #[doc = #doc]
        #[derive(Debug, Clone, Default, ::clap::Args, ::serde::Serialize)]
        #vis struct #flags {
            #(#fields)*
        }

        impl #flags {
            /// Each flag's clap id with the JSON pointer of its setting under `prefix`, for
            /// `--help` to show the defaults the config struct has.
            pub fn setting_keys(prefix: &str, out: &mut Vec<(&'static str, String)>) {
                #(#keys)*
            }
        }
    })
}
